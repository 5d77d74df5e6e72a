"""An independent numpy model of Hopper's documented data layouts, written from the PTX ISA text
(not from fagen/emulator/hopper.h), for tests/test_wgmma_primitives.py.

Sections (PTX ISA 8.x): 9.7.15.5.1 "Matrix Descriptor Format" and "Shared Memory Matrix Layout"
(canonical K-major / MN-major layouts, 32B / 64B / 128B swizzling modes), 9.7.15.5 "Register
Fragments and Shared Memory Matrix Layouts" (wgmma's accumulator D and register A fragments,
figures: the m64nNk16 D fragment is the m16n8k16 C fragment of each of the four warps, rows
16w..16w+15, repeated every 8 columns), 9.7.14.5.16 stmatrix (8x8 matrices of 16-bit
elements, each group of four lanes holds one row), 9.7.9.25 cp.async.bulk.tensor (the tile mode's
bounding box, filled with zeros outside the tensor).

Every function takes ``mutation`` (None = the documented behaviour): the mutation tests show
that a model with a swapped register, a wrong swizzle XOR or LBO/SBO used the wrong way round
disagrees with what the emulator computes, so the comparisons can fail.
"""
from __future__ import annotations

import numpy as np

SWIZZLE_MODE = {0: 0, 128: 1, 64: 2, 32: 3}  # span in bytes -> descriptor bits 62-63


def encode_desc(start: int, lbo: int, sbo: int, swizzle: int) -> int:
    """Matrix descriptor: bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 49-51 base offset
    (0), 62-63 swizzle mode."""
    return ((start >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32) | \
        (SWIZZLE_MODE[swizzle] << 62)


def swizzled(addr: np.ndarray, span: int, mutation: str | None = None) -> np.ndarray:
    """The swizzling modes as the ISA draws them: shared memory is cut into lines of ``span``
    bytes; in each repeating pattern of 8 x 128 bytes the 16-byte chunks of a line are permuted
    by XOR with the line's position in the pattern: with 128B every 128-byte line gets its own
    value 0..7, with 64B two consecutive 64-byte lines share one of 0..3, with 32B four
    consecutive 32-byte lines share 0 or 1."""
    addr = np.asarray(addr, np.int64)
    if span == 0:
        return addr
    line = addr // span
    chunk = (addr % span) // 16
    lines_per_value = 128 // span
    value = (line // lines_per_value) % (span // 16)
    if mutation == "swizzle_xor":  # a plausible slip: the XOR value taken one address bit too high
        value = (addr // 256) % (span // 16)
    return line * span + (chunk ^ value) * 16 + addr % 16


def operand_addresses(rows: int, mn_major: bool, swizzle: int, start: int, lbo: int, sbo: int,
                      mutation: str | None = None) -> np.ndarray:
    """[rows, 16] byte addresses of a 16-bit operand (A: rows = M = 64, B: rows = N) in one of
    the canonical layouts the descriptor describes (K = 16 per wgmma)."""
    if mutation == "lbo_sbo":
        lbo, sbo = sbo, lbo
    mn = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    if not mn_major:
        if swizzle == 0:  # core matrices of 8 rows x 16 bytes; LBO steps K, SBO steps MN
            a = start + (mn // 8) * sbo + (k // 8) * lbo + (mn % 8) * 16 + (k % 8) * 2
        else:  # a row of K elements per swizzle line; 8-row groups SBO apart
            a = start + (mn // 8) * sbo + (mn % 8) * swizzle + k * 2
    else:
        if swizzle == 0:  # core matrices of 8 K rows x 8 MN elements; SBO steps MN, LBO steps K
            a = start + (mn // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (mn % 8) * 2
        else:  # MN along the swizzle line; atoms of 8 K lines; LBO steps MN atoms, SBO steps K by 8
            per_line = swizzle // 2
            a = start + (mn // per_line) * lbo + (mn % per_line) * 2 + (k // 8) * sbo + (k % 8) * swizzle
    return swizzled(a, swizzle, mutation)


def canonical_params(rows: int, mn_major: bool, swizzle: int) -> tuple[int, int, int]:
    """(lbo, sbo, bytes) of a compact tile in the canonical layout (LBO 0x3ff0 where unused)."""
    if not mn_major:
        if swizzle == 0:
            return 128, 256, (rows // 8) * 256
        return 0x3FF0, 8 * swizzle, (rows // 8) * 8 * swizzle  # LBO unused (k16 fits one line)
    if swizzle == 0:
        return (rows // 8) * 128, 128, (rows // 8) * 256
    atoms = -(-rows // (swizzle // 2))
    return 8 * swizzle, atoms * 8 * swizzle, atoms * 16 * swizzle


def d_position(tid: np.ndarray | int, i: np.ndarray | int, mutation: str | None = None):
    """(row, col) of D held in register d[i] of warpgroup thread ``tid``: warp w = tid // 32
    owns rows 16w..16w+15 in mma.m16n8k16's C layout (row g or g + 8, columns 2t, 2t + 1),
    repeated for every 8 columns of N."""
    tid, i = np.asarray(tid), np.asarray(i)
    w, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    half = (i // 2) % 2
    col_lo = i % 2
    if mutation == "d_regs":
        half, col_lo = col_lo, half
    return 16 * w + g + 8 * half, 8 * (i // 4) + 2 * t + col_lo


def a_register_position(tid: int, r: int, j: int, mutation: str | None = None) -> tuple[int, int]:
    """(row, col) of A in half j (0 low) of register a[r] of thread ``tid`` (register-A wgmma):
    mma.m16n8k16's A layout per warp, rows 16w..16w+15."""
    w, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    hi_row, hi_col = r % 2, r // 2
    if mutation == "a_regs":
        hi_row, hi_col = hi_col, hi_row
    return 16 * w + g + 8 * hi_row, 2 * t + j + 8 * hi_col


def stmatrix_position(lane: int, j: int) -> tuple[int, int]:
    """(row, col) of an 8x8 matrix that half j of a lane's register holds (stmatrix / ldmatrix
    fragment: lane l holds row l // 4, columns 2 (l % 4) and 2 (l % 4) + 1)."""
    return lane // 4, 2 * (lane % 4) + j


def tma_box(tensor: np.ndarray, coords: tuple[int, ...], box: tuple[int, ...],
            element_strides: tuple[int, ...] | None = None, fill: float | int = 0) -> np.ndarray:
    """The box a tiled TMA load brings in (torch order, outermost first): element j of the box
    along each dimension is the tensor's element at coords + j * element_stride, or ``fill``
    where that is outside the tensor."""
    es = element_strides or (1,) * len(box)
    ext = tuple(-(-b // e) for b, e in zip(box, es))
    out = np.full(ext, fill, tensor.dtype)
    for idx in np.ndindex(*ext):
        src = tuple(c + j * e for c, j, e in zip(coords, idx, es))
        if all(0 <= s < n for s, n in zip(src, tensor.shape)):
            out[idx] = tensor[src]
    return out


def smem_image_of_box(box_values: np.ndarray, base: int, swizzle: int,
                      mutation: str | None = None) -> dict[int, bytes]:
    """Where each element of a TMA box lands: dense, innermost dimension first, from ``base``,
    then swizzled: {byte address: element bytes}."""
    flat = np.ascontiguousarray(box_values).reshape(-1)
    eb = flat.dtype.itemsize
    addrs = swizzled(base + np.arange(flat.size) * eb, swizzle, mutation)
    raw = flat.view(np.uint8).reshape(-1, eb)
    return {int(a): raw[n].tobytes() for n, a in enumerate(addrs)}
