"""How many splits of a sequence the paged decode kernel runs (engine/layers/paged_decode_triton.py).

By default the count depends on the batch: enough programs to fill the GPU, so a sequence decoded
alone takes 32 splits and one among 32 others 2. Each split's online softmax and the merge of the
splits round differently for every count, so a row's bits depend on the batch it is in.

In batch-invariant mode (`--batch-invariant`, for a verifier whose greedy output must be plain
decoding's bit for bit) every step takes the same count, BATCH_INVARIANT_SPLITS: a split's keys are
then fixed by the sequence's own KV length (ceil(len / count), rounded up to the kernel's block),
splits past its end are empty and weigh nothing, and the merge reduces the same number of partial
results in the same order whatever else the step holds. The CUDA graphs of every bucket then launch
that many splits. Only steps whose projections are row-invariant too (`rows_invariant`) take it:
past that limit cuBLAS rounds by row count anyway.

The count is 8, not a lone sequence's 32: at batch 32 a count of 32 launches 32 x 8 x 32 programs a
layer, most of them empty at short contexts (a 224-key sequence fills 4 splits of 64 keys with either
count), and the mode with 32 ran at 0.77x of plain decoding's tok/s at batch 32 on an H200. 8 splits still
give a lone sequence 64 programs; what each count costs per batch and context: benchmarks/decode_splits_cost.py.
"""

from __future__ import annotations

MAX_SPLITS = 32
BATCH_INVARIANT_SPLITS = 8


def num_splits_for(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU twice over, at most MAX_SPLITS splits per sequence."""
    want = -(-2 * num_sms // max(1, batch * num_kv_heads))
    return max(1, min(MAX_SPLITS, want))


def batch_invariant_splits(num_kv_heads: int) -> int:
    """The split count of every step in batch-invariant mode: BATCH_INVARIANT_SPLITS, or a lone
    sequence's count where that is smaller (many KV heads)."""
    return min(BATCH_INVARIANT_SPLITS, num_splits_for(1, num_kv_heads))


def step_splits(requests: int, num_kv_heads: int, batch_invariant: bool, rows_invariant: bool) -> int:
    """Splits per row for a decode or verify step of `requests` requests: plain decoding's count for
    that batch, or the batch-invariant count where the mode is on and the step's projections are
    row-invariant (its rows fit the row-invariant kernel)."""
    if batch_invariant and rows_invariant:
        return batch_invariant_splits(num_kv_heads)
    return num_splits_for(requests, num_kv_heads)
