"""A lone fresh prompt's cuDNN buckets (engine/layers/prompt_attention.py): which lengths are built, which
bucket a prompt is padded to, and the padded projection. The attention itself is CUDA-only
(tests/engine/test_gpu_path.py)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.layers.prompt_attention import (
    BUCKET_MAX,
    bucket_lengths,
    bucket_limit,
    long_prompt_bucket,
    padded_projection,
    prompt_bucket,
)


@pytest.mark.parametrize("longest,context,limit", [
    (2048, 131072, 2048),  # the default chunk budget: 8 graphs
    (2000, 131072, 2048),  # rounded up: a 2000-token chunk still has its bucket
    (8192, 131072, BUCKET_MAX),  # a bigger budget: past 4096, long buckets built on first use
    (131072, 131072, BUCKET_MAX),  # chunked prefill off
    (2048, 1024, 768),  # a short context: no bucket longer than a warm-up prompt (context - 64)
    (2048, 300, 0),  # too short for any bucket: every lone prompt takes flash attention
])
def test_the_largest_bucket_covers_the_longest_lone_prompt_within_the_cap_and_the_context(
        longest: int, context: int, limit: int) -> None:
    assert bucket_limit(longest, context) == limit


def test_the_buckets_are_the_multiples_of_the_step_up_to_the_limit() -> None:
    assert bucket_lengths(2048) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert bucket_lengths(0) == []
    assert len(bucket_lengths(BUCKET_MAX)) == 16


@pytest.mark.parametrize("length,bucket", [(1, 256), (255, 256), (256, 256), (257, 512), (1000, 1024),
                                           (2047, 2048), (2048, 2048), (2049, None), (5000, None)])
def test_a_prompt_is_padded_to_the_next_bucket_and_past_the_last_has_none(length: int, bucket: int | None) -> None:
    assert prompt_bucket(length, 2048) == bucket
    if bucket is not None:
        assert bucket in bucket_lengths(2048) and bucket - 256 < length <= bucket  # < 256 padded rows


def test_every_length_up_to_the_limit_has_a_built_bucket() -> None:
    built = set(bucket_lengths(bucket_limit(2048, 4096)))
    assert {prompt_bucket(n, 2048) for n in range(1, 2049)} == built


@pytest.mark.parametrize("length,bucket", [(4097, 5120), (5120, 5120), (5121, 6144), (8192, 8192), (8193, 10240),
                                           (16000, 16384), (16385, 20480), (131072, 131072)])
def test_a_prompt_past_the_fine_buckets_is_padded_to_a_quarter_octave(length: int, bucket: int) -> None:
    assert long_prompt_bucket(length) == bucket
    octave_low = 1 << (length - 1).bit_length() - 1  # the power of two below the length
    assert bucket - length < octave_low // 4 and bucket % (octave_low // 4) == 0


def test_a_server_meets_four_long_buckets_an_octave() -> None:
    assert sorted({long_prompt_bucket(n) for n in range(BUCKET_MAX + 1, 4 * BUCKET_MAX + 1)}) == [
        5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384]
    with pytest.raises(ValueError, match="more than 4096"):
        long_prompt_bucket(BUCKET_MAX)


@pytest.mark.parametrize("length,bucket", [(1, 256), (97, 256), (256, 256), (300, 512)])
def test_the_padded_projection_is_the_prompt_s_rows_then_zeros_in_one_layout_either_way_in(length: int,
                                                                                         bucket: int) -> None:
    heads, kv_heads, dim = 6, 2, 16
    qkv = torch.randn(length, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16)
    q, k, v = (t.view(length, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1))
    packed = padded_projection(q, k, v, bucket, qkv)
    concatenated = padded_projection(q.clone(), k.clone(), v.clone(), bucket)  # separate tensors (a q/k-norm model)
    for padded in (packed, concatenated):
        assert padded.shape == (bucket, qkv.shape[1]) and padded.stride() == (qkv.shape[1], 1)
        assert torch.equal(padded[:length], qkv) and not padded[length:].any()
