"""The engine benchmark's steps built by hand: a mixed step (decode rows beside fresh prompts) and a packed prefill,
each a batch the runner runs whole, whose pages go back after; and the held-rate timer."""

from __future__ import annotations

import time

import torch

from splitserve.bench.engine_steps import EngineUnderTest, sustained_rate


def test_a_mixed_step_has_a_logits_row_for_every_decode_row_and_prompt_and_gives_its_pages_back() -> None:
    eut = EngineUnderTest("tiny", "cpu", 8, 4096)
    free = eut.kv.allocator.free_count
    with eut.mixed_step(2, 40, 3, 100) as (reqs, batch):
        assert len(reqs) == 5 and eut.kv.allocator.free_count < free
        assert batch.input_ids.shape == (3 + 2 * 40,)
        assert batch.positions.tolist()[:3] == [100, 100, 100]  # the decode rows first, at their context
        logits = eut.runner.forward(batch)
        assert logits.shape == (5, eut.model_cfg.vocab_size) and torch.isfinite(logits).all()
    assert eut.kv.allocator.free_count == free
    with eut.prefill_step(64, 2) as (_, batch):
        assert eut.runner.forward(batch).shape == (2, eut.model_cfg.vocab_size)
    assert eut.kv.allocator.free_count == free


def test_a_decode_step_timed_over_several_runs_gives_its_pages_back() -> None:
    eut = EngineUnderTest("tiny", "cpu", 4, 4096)
    free = eut.kv.allocator.free_count
    seconds = eut.decode_step_seconds(2, 100, steps=3, blocks=3)
    assert 0 < seconds < 1 and eut.kv.allocator.free_count == free


def test_the_held_rate_times_the_second_half_of_back_to_back_calls() -> None:
    def call() -> None:
        time.sleep(0.01)

    rate = sustained_rate(call, torch.device("cpu"), 0.4)
    assert 40 < rate < 101  # ~10 ms a call (sleep never returns early): at most 100 calls a second
