"""KV layouts: buffers from a pool, validation, head ranges and which prefill rank feeds which heads."""

from __future__ import annotations

import pytest
import torch

from splitserve.transfer import KVLayout, LayoutMismatchError, head_range, layout_for_pool, make_aux_tensor
from splitserve.transfer.kv.layout import HeadSource, decode_ranks_per_prefill_rank, head_sources


def test_pool_becomes_one_buffer_per_layer_and_kv_with_page_strides():
    pool = torch.zeros((3, 2, 10, 4, 2, 8), dtype=torch.bfloat16)
    layout = layout_for_pool(pool, make_aux_tensor(5))
    assert len(layout.buffers) == 6
    page_bytes = 4 * 2 * 8 * 2
    assert all(b.page_bytes == page_bytes and b.num_pages == 10 for b in layout.buffers)
    assert layout.buffers[3].ptr == pool[1, 1].data_ptr() == pool.data_ptr() + 3 * 10 * page_bytes
    assert (layout.aux.slot_bytes, layout.aux.num_slots) == (12, 5)
    assert KVLayout.from_dict(layout.to_dict()) == layout


def test_head_ranges_split_evenly_or_replicate():
    assert [head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError):
        head_range(6, 4, 0)


def test_head_sources_across_tp_sizes():
    # decode tp 1 (all 4 heads) from prefill tp 2
    assert head_sources(2, 4, 0, 4) == [HeadSource(0, 0, 2), HeadSource(1, 2, 2)]
    # decode tp 4 rank 3 (head 3) from prefill tp 2
    assert head_sources(2, 4, 3, 1) == [HeadSource(1, 3, 1)]
    # replicated prefill (tp 4, 2 heads): only the first holder of each head sends
    assert head_sources(4, 2, 0, 2) == [HeadSource(0, 0, 1), HeadSource(2, 1, 1)]
    assert decode_ranks_per_prefill_rank(1, 2, 4) == [2]
    assert decode_ranks_per_prefill_rank(2, 1, 4) == [1, 1]
    assert decode_ranks_per_prefill_rank(4, 1, 2) == [1, 0, 1, 0]


def test_inconsistent_layouts_are_refused_with_the_field():
    pool = torch.zeros((1, 2, 4, 4, 2, 8), dtype=torch.float16)
    layout = layout_for_pool(pool, make_aux_tensor(2))
    with pytest.raises(LayoutMismatchError, match="head range"):
        KVLayout(**{**layout.__dict__, "head_start": 1, "head_count": 1, "num_kv_heads": 2})
    other = layout_for_pool(torch.zeros((1, 2, 4, 8, 2, 8), dtype=torch.float16), make_aux_tensor(2))
    with pytest.raises(LayoutMismatchError) as info:
        layout.check_compatible(other)
    assert (info.value.field, info.value.expected, info.value.actual) == ("page_size", 4, 8)
    with pytest.raises(LayoutMismatchError, match="heads in pool"):
        layout_for_pool(pool, make_aux_tensor(2), tp_size=2, tp_rank=0, num_kv_heads=2)


def test_fp8_pages_written_with_other_scales_are_refused():
    """An FP8 cache's calibrated scales travel in the layout: pages written with other scales would be read
    wrong. A peer that names none (1.0 throughout, or a layout from before the field) agrees with 1.0."""
    pool = torch.zeros((1, 2, 4, 4, 2, 8), dtype=torch.float8_e4m3fn)
    calibrated = layout_for_pool(pool, make_aux_tensor(2), kv_scales="kv-scales:0123abcd")
    plain = layout_for_pool(pool, make_aux_tensor(2))
    with pytest.raises(LayoutMismatchError, match="kv_scales expected 'kv-scales:0123abcd', got ''"):
        calibrated.check_compatible(plain)
    calibrated.check_compatible(KVLayout.from_dict(calibrated.to_dict()))
    older = {k: v for k, v in plain.to_dict().items() if k != "kv_scales"}
    plain.check_compatible(KVLayout.from_dict(older))
