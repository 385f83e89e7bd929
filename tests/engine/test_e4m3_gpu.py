"""e4m3 widened to bfloat16 in integer operations (engine/layers/e4m3_triton.py), in both placements, against
torch's cast, for every code (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from splitserve.engine.layers.e4m3_triton import widen_e4m3, widen_e4m3_where_loaded  # noqa: E402  (Triton only where it is installed)

NAN_CODES = (0x7F, 0xFF)


@triton.jit
def _widen(X, Y, N, BLOCK: tl.constexpr, WHERE_LOADED: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < N, other=0.0)
    if WHERE_LOADED:
        y = widen_e4m3_where_loaded(x, Y.dtype.element_ty)
    else:
        y = widen_e4m3(x, Y.dtype.element_ty)
    tl.store(Y + i, y, mask=i < N)


def widened(codes: torch.Tensor, dtype: torch.dtype, where_loaded: bool, block: int = 1024) -> torch.Tensor:
    """Widened in tiles of `block` codes over 4 warps (128 threads): from several of the assembly's packs of 4 a
    thread down to fewer codes than threads, where the compiler pads the packs."""
    out = torch.empty(codes.shape, dtype=dtype, device="cuda")
    _widen[(triton.cdiv(codes.numel(), block),)](codes.view(torch.float8_e4m3fn), out, codes.numel(), BLOCK=block,
                                                 WHERE_LOADED=where_loaded, num_warps=4)
    return out


@pytest.mark.parametrize("block", [1024, 256, 64])
@pytest.mark.parametrize("where_loaded", [False, True], ids=["movable", "where-loaded"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_finite_code_widens_to_torch_s_value_bit_for_bit(dtype: torch.dtype, where_loaded: bool,
                                                               block: int) -> None:
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(8)  # several tiles' worth, every lane
    finite = ~torch.isin(codes, torch.tensor(NAN_CODES, dtype=torch.uint8, device="cuda"))
    got = widened(codes, dtype, where_loaded, block)
    want = codes.view(torch.float8_e4m3fn).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got[finite].view(bits), want[finite].view(bits))
    subnormal = (codes & 0x78) == 0  # exponent field 0: zero and the 7 subnormals of each sign
    assert int((got[subnormal & (codes & 0x07 != 0)].float().abs() > 0).sum()) == 14 * 8


@pytest.mark.parametrize("where_loaded", [False, True], ids=["movable", "where-loaded"])
def test_the_nan_codes_widen_to_480_in_bfloat16(where_loaded: bool) -> None:
    codes = torch.tensor(NAN_CODES * 2, dtype=torch.uint8, device="cuda")
    assert widened(codes, torch.bfloat16, where_loaded).float().tolist() == [480.0, -480.0] * 2
