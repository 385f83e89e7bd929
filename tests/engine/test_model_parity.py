"""The engine's model matches Hugging Face transformers on the same random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk

transformers = pytest.importorskip("transformers")


from engine_checkpoints import CHECKPOINTS, cpu_runner, write  # noqa: E402  (tests/ is on sys.path: conftest.py)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> Path:
    return write(request.param, tmp_path_factory.mktemp(request.param))


def all_position_logits(runner: ModelRunner, chunks: list[ScheduledChunk], kv: KVCache) -> torch.Tensor:
    batch = build_forward_batch(chunks, kv.page_table, kv.page_size, runner.device)
    batch.logits_index = torch.arange(batch.input_ids.shape[0])
    return runner.model(batch, runner.kv_pool)


@torch.inference_mode()
def test_prefill_chunks_and_decode_steps_match_transformers(checkpoint: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    runner, kv = cpu_runner(checkpoint)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (13,), generator=gen).tolist()
    decode_tokens = torch.randint(0, 256, (5,), generator=gen).tolist()
    full = prompt + decode_tokens
    want = hf(torch.tensor([full])).logits[0]

    req = Request("r", list(prompt), SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    got = []
    # Prefill in two chunks (5 then 8 tokens: the second spans a page boundary mid-page).
    for start, length in ((0, 5), (5, 8)):
        assert kv.grow(req, start + length)
        got.append(all_position_logits(runner, [ScheduledChunk(req, start, length, True)], kv))
        req.kv_len = start + length
    # Then one token at a time, as decode does.
    for tok in decode_tokens:
        req.output_ids.append(tok)
        assert kv.grow(req, req.kv_len + 1)
        got.append(all_position_logits(runner, [ScheduledChunk(req, req.kv_len, 1, True)], kv))
        req.kv_len += 1
    got_all = torch.cat(got)
    assert got_all.shape == want.shape
    torch.testing.assert_close(got_all, want, atol=2e-4, rtol=2e-4)
    assert torch.equal(got_all.argmax(-1), want.argmax(-1))


@torch.inference_mode()
def test_batched_sequences_of_different_lengths_match_running_alone(checkpoint: Path) -> None:
    """Padding and masks in a mixed batch (prefill chunks beside decodes) change nothing."""
    runner, kv = cpu_runner(checkpoint)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 9, 17)]
    alone = []
    for p in prompts:
        req = Request(f"a{len(p)}", list(p), SamplingParams(), on_output=lambda _o: None)
        kv.admit(req, 0)
        kv.grow(req, len(p))
        alone.append(all_position_logits(runner, [ScheduledChunk(req, 0, len(p), True)], kv))
        kv.release(req, cache_prefix=False)
    reqs = [Request(f"b{len(p)}", list(p), SamplingParams(), on_output=lambda _o: None) for p in prompts]
    for r in reqs:
        kv.admit(r, 0)
        kv.grow(r, len(r.prompt_ids))
    batched = all_position_logits(runner, [ScheduledChunk(r, 0, len(r.prompt_ids), True) for r in reqs], kv)
    torch.testing.assert_close(batched, torch.cat(alone), atol=1e-5, rtol=1e-5)
