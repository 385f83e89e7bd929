"""The paged decode kernel's split choice (engine/layers/decode_splits.py), on any machine."""

from __future__ import annotations

import pytest

from splitserve.engine.layers.decode_splits import (
    BATCH_INVARIANT_SPLITS,
    MAX_SPLITS,
    batch_invariant_splits,
    num_splits_for,
    step_splits,
)

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 256)


@pytest.mark.parametrize("kv_heads", [1, 2, 8, 32])
def test_plain_decoding_splits_fill_the_gpu_and_shrink_with_the_batch(kv_heads: int) -> None:
    counts = [num_splits_for(b, kv_heads) for b in BATCHES]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1 and counts[0] <= MAX_SPLITS
    for b, n in zip(BATCHES, counts, strict=True):  # at least 2 x 132 programs unless capped at MAX_SPLITS
        assert n == MAX_SPLITS or b * kv_heads * n >= 2 * 132


def test_plain_decoding_rounds_by_batch_which_batch_invariant_mode_does_not() -> None:
    kv_heads = 8  # the 8B shape: 32 splits alone, 5 among 8 requests, 2 among 32
    assert [num_splits_for(b, kv_heads) for b in (1, 8, 32)] == [32, 5, 2]
    plain = {step_splits(b, kv_heads, batch_invariant=False, rows_invariant=True) for b in BATCHES}
    invariant = {step_splits(b, kv_heads, batch_invariant=True, rows_invariant=True) for b in BATCHES}
    assert len(plain) > 1
    assert invariant == {batch_invariant_splits(kv_heads)} == {BATCH_INVARIANT_SPLITS}
    assert batch_invariant_splits(64) == num_splits_for(1, 64) < BATCH_INVARIANT_SPLITS  # never more than alone


def test_steps_past_the_row_invariant_limit_keep_plain_decodings_count() -> None:
    # Their projections round by row count on cuBLAS anyway; the fixed count would only cost time.
    for b in BATCHES:
        assert step_splits(b, 8, batch_invariant=True, rows_invariant=False) == num_splits_for(b, 8)
