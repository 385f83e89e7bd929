"""The last decoder layer of an extend step runs its output projection and MLP on the sampled rows alone.

A row's output after the last layer's attention feeds only its own logits (the KV later tokens read is stored
before it), so the other rows' work there is dropped: the sampled rows' logits and every KV row must be what a
forward that keeps all rows gives, and the dropped rows must really not run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checkpoints import CHECKPOINTS, cpu_runner, write

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> Path:
    return write(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def runner_and_kv(checkpoint: Path) -> tuple[ModelRunner, KVCache]:
    return cpu_runner(checkpoint)


def mlp_rows(runner: ModelRunner) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """The row counts the last layer's MLP runs at, recorded by a hook."""
    seen: list[int] = []
    handle = runner.model.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    return seen, handle


@torch.inference_mode()
def test_a_mixed_step_samples_the_rows_a_full_forward_gives_and_stores_the_same_kv(runner_and_kv) -> None:
    runner, kv = runner_and_kv
    gen = torch.Generator().manual_seed(2)
    decoding = Request("d", torch.randint(0, 256, (6,), generator=gen).tolist(), SamplingParams(),
                       on_output=lambda _o: None)
    kv.admit(decoding, 0)
    kv.grow(decoding, 7)
    decoding.output_ids.append(5)
    decoding.kv_len = 6
    prompts = [Request(f"p{n}", torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(),
                       on_output=lambda _o: None) for n in (9, 13)]
    for r in prompts:
        kv.admit(r, 0)
        kv.grow(r, len(r.prompt_ids))
    # A decode row, a prompt that samples and a prompt chunk that does not (its prompt goes on next step).
    chunks = [ScheduledChunk(decoding, 6, 1, True), ScheduledChunk(prompts[0], 0, 9, True),
              ScheduledChunk(prompts[1], 0, 10, False)]
    batch = build_forward_batch(chunks, kv.page_table, kv.page_size, runner.device)
    assert batch.logits_index.tolist() == [0, 9]
    seen, handle = mlp_rows(runner)
    try:
        sampled = runner.model(batch, runner.kv_pool)
        kv_after_sampled = [t.clone() for t in (runner.kv_pool.k_cache(0), runner.kv_pool.v_cache(-1))]
        batch.logits_index = torch.arange(batch.input_ids.shape[0])
        every_row = runner.model(batch, runner.kv_pool)
    finally:
        handle.remove()
    assert seen == [2, 20]  # the sampled rows, then (asked for every row) all 20
    torch.testing.assert_close(sampled, every_row[[0, 9]], atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_after_sampled[0], runner.kv_pool.k_cache(0))
    assert torch.equal(kv_after_sampled[1], runner.kv_pool.v_cache(-1))


@torch.inference_mode()
def test_a_step_that_samples_nothing_runs_no_row_past_the_last_attention(runner_and_kv) -> None:
    runner, kv = runner_and_kv
    req = Request("r", list(range(1, 12)), SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, 0)
    kv.grow(req, 8)
    batch = build_forward_batch([ScheduledChunk(req, 0, 8, False)], kv.page_table, kv.page_size, runner.device)
    seen, handle = mlp_rows(runner)
    try:
        logits = runner.model(batch, runner.kv_pool)
    finally:
        handle.remove()
    assert seen == [0] and logits.shape == (0, runner.model.cfg.vocab_size)
