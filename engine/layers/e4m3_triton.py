"""e4m3 widened to the 16-bit dtype a kernel multiplies in, in Triton.

Two things make a plain cast slow in a kernel that streams e4m3 (FP8 weights at decode rows, FP8 KV pages):
- **Conversions.** Hopper converts e4m3 to float16 in one instruction a pair, but to bfloat16 only through
  float16 and a second conversion a value, on the unit that converts a quarter as fast as the integer ALU.
  `widen_e4m3` builds the bfloat16 bits in integer operations instead: each code's sign to bit 15 and its other
  seven bits to bits 10-4 (e4m3's exponent and mantissa, in bfloat16's places), which is the code's value times
  2^-120 (the exponent biases, 7 and 127, apart), then one bfloat16 multiply a pair by 2^120. Exact for every
  finite code, subnormals included (bfloat16 multiplies keep subnormal inputs).
- **Where the compiler puts the layout change.** A cast, or a pure inline-assembly op, is elementwise, so the
  compiler moves the change to the tensor-core operand's layout ahead of it, onto the narrower e4m3 tile. For
  an operand whose reduction axis is the contiguous one in memory (the skinny kernel's weight) that costs
  nothing. For one whose reduction axis is not (the value tile of attention: [tokens, head_dim], reduced over
  tokens) the e4m3 tile is gathered from shared memory a byte at a time, as there is no transposing ldmatrix
  for 8-bit elements (benchmarks/kernel_sass.py counts them: 128 LDS.U8 in the decode kernel).
  `widen_e4m3_where_loaded` is the same assembly marked impure, which the compiler does not move: the tile
  widens where it is loaded, and the 16-bit tile takes the transposing ldmatrix, as a 16-bit cache's does.

The two NaN codes (0x7F, 0xFF) widen to +-480 in bfloat16; nothing the engine stores or loads holds them (its
quantizers saturate at +-448, and checkpoints are checked on load). float16 and float32 take the cast.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Four codes [c3 c2 c1 c0] in one register; two registers of pairs out: [c1 c0] and [c3 c2].
_E4M3_TO_BF16 = tl.constexpr("""{
    .reg .b32 lo, hi, two_120;
    mov.b32 two_120, 0x7B807B80;
    prmt.b32 lo, $2, 0, 0x1404;
    prmt.b32 hi, $2, 0, 0x3424;
    shr.b32 $0, lo, 4;
    and.b32 $0, $0, 0x07F007F0;
    lop3.b32 $0, $0, lo, 0x80008000, 0xF8;
    mul.rn.bf16x2 $0, $0, two_120;
    shr.b32 $1, hi, 4;
    and.b32 $1, $1, 0x07F007F0;
    lop3.b32 $1, $1, hi, 0x80008000, 0xF8;
    mul.rn.bf16x2 $1, $1, two_120;
}""")


@triton.jit
def _widen(x, dtype: tl.constexpr, movable: tl.constexpr):
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=movable, pack=4)
    else:
        return x.to(dtype)


@triton.jit
def widen_e4m3(x, dtype: tl.constexpr):
    """e4m3 tile `x` as `dtype`, exactly: bfloat16 in integer operations, any other dtype by a cast; the compiler
    may change the tile's layout before it widens (right for a tile reduced along its contiguous axis)."""
    return _widen(x, dtype, True)


@triton.jit
def widen_e4m3_where_loaded(x, dtype: tl.constexpr):
    """widen_e4m3, kept where it is written (impure): a bfloat16 tile that the compiler then lays out for the
    tensor cores in 16 bits (an attention tile reduced across its rows)."""
    return _widen(x, dtype, False)
