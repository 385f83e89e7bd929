"""Sampling backends: greedy and full sample/verify, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine.sampling import (
    FullSampler,
    GreedySampler,
    SamplingBatch,
    SamplingShapeError,
    backend_for,
)
from splitserve.engine.sampling.logprobs import token_logprobs
from splitserve.engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
V = 32


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def make_batch(slots: list[int], params: list[SamplingParams], device: str = "cpu") -> SamplingBatch:
    return SamplingBatch(torch.tensor(slots, dtype=torch.int64, device=device), params)


def full_with(
    params: list[SamplingParams], device: str = "cpu", prompts: list[list[int]] | None = None,
    vocab: int = V, seed: int = 0,
) -> tuple[FullSampler, SamplingBatch]:
    """A FullSampler with params[i] reset into slot i, and the batch of those slots."""
    sampler = FullSampler(max_slots=max(len(params), 8), vocab_size=vocab, device=device, seed=seed)
    for slot, p in enumerate(params):
        sampler.reset_slot(slot, p, prompts[slot] if prompts else [])
    return sampler, make_batch(list(range(len(params))), params, device)


def probs_logits(probs: list[float], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(probs, device=device).log()


# -- greedy ------------------------------------------------------------------------------------


def test_greedy_sample_is_argmax(device: str) -> None:
    logits = torch.randn(6, V, device=device, generator=torch.Generator(device).manual_seed(1))
    out = GreedySampler().sample(logits, make_batch(list(range(6)), [SamplingParams()] * 6, device))
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.accept_lengths.tolist() == [1] * 6
    assert out.logprobs is None and out.top_logprobs is None


def verify_logits(argmaxes: list[list[int]], device: str) -> torch.Tensor:
    """[B, K+1, V] logits whose argmax at each position is the given token."""
    logits = torch.zeros(len(argmaxes), len(argmaxes[0]), V, device=device)
    for b, row in enumerate(argmaxes):
        for j, token in enumerate(row):
            logits[b, j, token] = 5.0
    return logits


def test_greedy_verify_accepts_matching_prefix_then_corrects(device: str) -> None:
    logits = verify_logits([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]], device)
    candidates = torch.tensor([[3, 4, 5], [3, 9, 5], [7, 4, 5], [3, 4, 8]], device=device)
    batch = make_batch([0, 1, 2, 3], [SamplingParams(temperature=0.0)] * 4, device)
    out = GreedySampler().verify(logits, candidates, batch)
    assert out.accept_lengths.tolist() == [4, 2, 1, 3]
    assert out.tokens.tolist() == [
        [3, 4, 5, 6],  # all accepted, plus the bonus
        [3, 4, -1, -1],  # second rejected, corrected to 4
        [3, -1, -1, -1],  # first rejected
        [3, 4, 5, -1],  # third rejected, corrected to 5
    ]


def test_greedy_verify_stops_at_first_mismatch_even_if_later_match(device: str) -> None:
    logits = verify_logits([[1, 2, 3]], device)
    out = GreedySampler().verify(logits, torch.tensor([[0, 2]], device=device),
                                 make_batch([0], [SamplingParams()], device))
    assert out.accept_lengths.tolist() == [1]
    assert out.tokens.tolist() == [[1, -1, -1]]


def test_full_verify_at_temperature_zero_matches_greedy_verify(device: str) -> None:
    logits = torch.randn(5, 4, V, device=device, generator=torch.Generator(device).manual_seed(2))
    target = logits.argmax(-1)
    candidates = target[:, :3].clone()
    candidates[1, 0] = (candidates[1, 0] + 1) % V
    candidates[2, 2] = (candidates[2, 2] + 1) % V
    params = [SamplingParams(temperature=0.0)] * 5
    full, batch = full_with(params, device)
    want = GreedySampler().verify(logits, candidates, batch)
    for draft_probs in (None, torch.full((5, 3, V), 1.0 / V, device=device)):
        got = full.verify(logits, candidates, batch, draft_probs)
        assert torch.equal(got.tokens, want.tokens)
        assert got.accept_lengths.tolist() == want.accept_lengths.tolist() == [4, 1, 3, 4, 4]


# -- full: reductions to greedy --------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-4),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.1),
    ],
    ids=["temperature-0", "temperature-1e-4", "top-k-1", "temperature-0-with-filters"],
)
def test_full_sampler_reduces_to_greedy(params: SamplingParams, device: str) -> None:
    logits = torch.randn(16, V, device=device, generator=torch.Generator(device).manual_seed(3)) * 3
    full, batch = full_with([params] * 16, device)
    for _ in range(5):
        assert torch.equal(full.sample(logits, batch).tokens, logits.argmax(-1))


# -- full: seeds -------------------------------------------------------------------------------


def draw_sequence(sampler: FullSampler, slot: int, others: list[int], steps: int, device: str,
                  params: SamplingParams, other_params: SamplingParams) -> list[int]:
    """Tokens the request in `slot` gets over `steps` steps, batched with `others` (it goes in the middle)."""
    logits = torch.randn(steps, V, generator=torch.Generator().manual_seed(4)).to(device)
    order = [*others[: len(others) // 2], slot, *others[len(others) // 2 :]]
    row = order.index(slot)
    batch = make_batch(order, [params if s == slot else other_params for s in order], device)
    tokens = []
    for step in range(steps):
        out = full_sample(sampler, logits[step].expand(len(order), V), batch)
        tokens.append(out[row])
    return tokens


def full_sample(sampler: FullSampler, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    return sampler.sample(logits.contiguous(), batch).tokens.tolist()


def test_seeded_sampling_is_reproducible_across_batch_compositions(device: str) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234)
    runs = []
    for slot, others, other_params in [
        (0, [], SamplingParams()),
        (5, [1, 2, 3], SamplingParams(temperature=0.7)),
        (2, [0, 1, 3, 4, 6, 7], SamplingParams(temperature=1.0, seed=99)),
    ]:
        sampler = FullSampler(max_slots=8, vocab_size=V, device=device, seed=slot)
        sampler.reset_slot(slot, seeded, [])
        for other in others:
            sampler.reset_slot(other, other_params, [])
        runs.append(draw_sequence(sampler, slot, others, 20, device, seeded, other_params))
    assert runs[0] == runs[1] == runs[2]


def test_different_seeds_give_different_tokens(device: str) -> None:
    params = [SamplingParams(seed=1), SamplingParams(seed=2), SamplingParams(seed=1)]
    full, batch = full_with(params, device)
    logits = torch.zeros(3, V, device=device)  # uniform over V: equal sequences by chance ~ V**-20
    rows = [full.sample(logits, batch).tokens.tolist() for _ in range(20)]
    seq = list(zip(*rows, strict=True))
    assert seq[0] == seq[2]
    assert seq[0] != seq[1]


def sample_and_commit(sampler: FullSampler, logits: torch.Tensor, batch: SamplingBatch, steps: int) -> list[int]:
    """A request's tokens over `steps` steps as the engine gets them: each sampled token is committed."""
    tokens = []
    for _ in range(steps):
        token = sampler.sample(logits, batch).tokens.item()
        sampler.commit(batch.slots, [[token]])
        tokens.append(token)
    return tokens


def test_reset_slot_restarts_the_seeded_sequence(device: str) -> None:
    params = SamplingParams(seed=7)
    full, batch = full_with([params], device)
    logits = torch.zeros(1, V, device=device)
    first = sample_and_commit(full, logits, batch, 10)
    assert len(set(first)) > 1
    full.reset_slot(0, params, [])
    assert sample_and_commit(full, logits, batch, 10) == first


def test_a_seeded_request_taken_over_elsewhere_draws_on_as_if_it_had_stayed(device: str) -> None:
    """Prefill samples the first token, decode (another sampler, another slot) resets its slot,
    commits that token and samples the rest: the tokens equal one sampler's whole run."""
    params = SamplingParams(temperature=1.0, seed=31)
    logits = torch.zeros(1, V, device=device)  # uniform: a restarted stream would show at once
    unified, batch = full_with([params], device)
    want = sample_and_commit(unified, logits, batch, 8)
    prefill, batch = full_with([params], device)
    got = sample_and_commit(prefill, logits, batch, 1)
    decode = FullSampler(max_slots=8, vocab_size=V, device=device, seed=5)
    decode.reset_slot(3, params, [])
    decode.commit(torch.tensor([3], device=device), [got])
    got += sample_and_commit(decode, logits, make_batch([3], [params], device), 7)
    assert got == want


def test_unseeded_sampling_follows_the_distribution(device: str) -> None:
    probs = [0.5, 0.25, 0.125, 0.125]
    full, _ = full_with([SamplingParams()], device, vocab=4)
    n = 20000
    batch = make_batch([0] * n, [SamplingParams()] * n, device)
    tokens = full.sample(probs_logits(probs, device).expand(n, 4).contiguous(), batch).tokens
    freq = torch.bincount(tokens, minlength=4).float().cpu() / n
    assert torch.allclose(freq, torch.tensor(probs), atol=0.02), freq


# -- full: filters ----------------------------------------------------------------------------


def empirical(params: SamplingParams, probs: list[float], device: str, n: int = 4000) -> torch.Tensor:
    """Frequencies of n draws of one request with these params from these probabilities."""
    full, _ = full_with([params], device, vocab=len(probs))
    batch = make_batch([0] * n, [params] * n, device)
    logits = probs_logits(probs, device).expand(n, len(probs)).contiguous()
    tokens = full.sample(logits, batch).tokens
    return torch.bincount(tokens, minlength=len(probs)).float().cpu() / n


def test_top_p_draws_only_from_the_nucleus(device: str) -> None:
    # Cumulative mass 0.5, 0.8, 0.95, 1.0: top_p 0.7 keeps {0, 1}, renormalised to 0.625 / 0.375.
    freq = empirical(SamplingParams(top_p=0.7), [0.5, 0.3, 0.15, 0.05], device)
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.625) < 0.04


def test_top_p_one_keeps_the_whole_vocabulary(device: str) -> None:
    freq = empirical(SamplingParams(top_p=1.0), [0.97, 0.01, 0.01, 0.01], device, n=20000)
    assert (freq[1:] > 0).all()


def test_top_k_draws_only_from_the_k_most_likely(device: str) -> None:
    freq = empirical(SamplingParams(top_k=2), [0.1, 0.4, 0.2, 0.3], device)
    assert freq[0] == 0 and freq[2] == 0
    assert abs(freq[1] - 4 / 7) < 0.04


def test_min_p_drops_tokens_below_the_scaled_maximum(device: str) -> None:
    # min_p 0.6 of the top 0.4 is 0.24: keeps 0.4 and 0.3, drops 0.2 and 0.1.
    freq = empirical(SamplingParams(min_p=0.6), [0.4, 0.3, 0.2, 0.1], device)
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 4 / 7) < 0.04


def test_filters_apply_per_row(device: str) -> None:
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.2)]
    full, _ = full_with(params, device, vocab=4)
    n = 3000
    slots = [0, 1, 2] * n
    batch = make_batch(slots, [params[s] for s in slots], device)
    logits = probs_logits([0.25, 0.25, 0.3, 0.2], device).expand(len(slots), 4).contiguous()
    tokens = full.sample(logits, batch).tokens.view(n, 3).cpu()
    assert (tokens[:, 0] == 2).all() and (tokens[:, 2] == 2).all()
    assert len(tokens[:, 1].unique()) == 4


# -- full: penalties and bias -----------------------------------------------------------------


def penalized(params: SamplingParams, logits: list[float], prompt: list[int], output: list[int],
              device: str) -> list[float]:
    full, batch = full_with([params], device, prompts=[prompt], vocab=len(logits))
    full.commit(batch.slots, [output])
    row = torch.tensor([logits], device=device)
    return full.penalized_logits(row, batch.slots, batch.params)[0].tolist()


LOGITS = [1.0, 2.0, -1.0, 3.0, -2.0, 0.5]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits(device: str) -> None:
    # Prompt saw 1 and 2, output saw 2 and 4; tokens 0, 3, 5 were never seen.
    got = penalized(SamplingParams(repetition_penalty=2.0), LOGITS, [1, 2], [2, 4, 4], device)
    assert got == pytest.approx([1.0, 1.0, -2.0, 3.0, -4.0, 0.5])


def test_frequency_penalty_subtracts_per_output_occurrence(device: str) -> None:
    # Prompt tokens do not count; output has 4 twice and 5 once.
    got = penalized(SamplingParams(frequency_penalty=0.5), LOGITS, [0, 1], [4, 5, 4], device)
    assert got == pytest.approx([1.0, 2.0, -1.0, 3.0, -3.0, 0.0])


def test_presence_penalty_subtracts_once_per_output_token(device: str) -> None:
    got = penalized(SamplingParams(presence_penalty=1.5), LOGITS, [0, 1], [4, 5, 4], device)
    assert got == pytest.approx([1.0, 2.0, -1.0, 3.0, -3.5, -1.0])


def test_penalties_and_bias_combine(device: str) -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={0: 10.0, 3: -1.0})
    got = penalized(params, LOGITS, [1], [3, 3], device)
    # token 1: 2/2; token 3: 3/2 - 2*0.5 - 0.25 - 1 = -0.75; token 0: 1 + 10.
    assert got == pytest.approx([11.0, 1.0, -1.0, -0.75, -2.0, 0.5])


def test_commit_accumulates_across_calls(device: str) -> None:
    full, batch = full_with([SamplingParams(frequency_penalty=1.0)] * 2, device, vocab=6)
    full.commit(batch.slots, [[1], [2, 2]])
    full.commit(batch.slots, [[1, 3], []])
    got = full.penalized_logits(torch.zeros(2, 6, device=device), batch.slots, batch.params)
    assert got.tolist() == [[0, -2, 0, -1, 0, 0], [0, 0, -2, 0, 0, 0]]


def test_penalties_steer_sampling_away_from_repeats(device: str) -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    full, batch = full_with([params], device, vocab=4)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]], device=device)
    emitted = []
    for _ in range(4):
        token = full.sample(logits, batch).tokens.tolist()
        full.commit(batch.slots, [token])
        emitted += token
    assert emitted == [0, 1, 2, 3]


def test_logit_bias_forces_and_bans_tokens(device: str) -> None:
    logits = torch.randn(64, V, device=device, generator=torch.Generator(device).manual_seed(5))
    forced = SamplingParams(logit_bias={7: 100.0})
    full, batch = full_with([forced], device)
    assert full.sample(logits, make_batch([0] * 64, [forced] * 64, device)).tokens.eq(7).all()

    banned_token = int(logits[0].argmax())
    banned = SamplingParams(temperature=0.0, logit_bias={banned_token: -100.0})
    full.reset_slot(1, banned, [])
    out = full.sample(logits[:1], make_batch([1], [banned], device))
    assert out.tokens.item() == int(logits[0].topk(2).indices[1])
    assert batch.params == [forced]


def test_reset_slot_clears_the_previous_requests_state(device: str) -> None:
    old = SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0, logit_bias={2: -50.0}, seed=3)
    full, batch = full_with([old], device, prompts=[[1, 4]], vocab=6)
    full.commit(batch.slots, [[4, 4, 5]])
    new = SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0)
    full.reset_slot(0, new, [0])
    row = torch.tensor([LOGITS], device=device)
    got = full.penalized_logits(row, batch.slots, [new])[0].tolist()
    # Only the new prompt's token 0 is penalised; 1, 4, 5 and the old bias on 2 are gone.
    assert got == pytest.approx([1.0 / 3.0, *LOGITS[1:]])
    assert 0 not in full.generators


# -- rejection sampling -----------------------------------------------------------------------


P = [0.1, 0.2, 0.3, 0.4]
P_BONUS = [0.7, 0.1, 0.1, 0.1]
Q = [0.4, 0.3, 0.2, 0.1]
N = 40000


def rejection_run(draft_probs: bool, device: str, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """N rows of verify() with target P at draft positions and P_BONUS at the bonus position."""
    full, _ = full_with([SamplingParams()], device, vocab=4, seed=11)
    batch = make_batch([0] * N, [SamplingParams()] * N, device)
    logits = torch.stack([probs_logits(P, device)] * k + [probs_logits(P_BONUS, device)])
    logits = logits.expand(N, k + 1, 4).contiguous()
    q = torch.tensor(Q, device=device)
    candidates = torch.multinomial(q.expand(N * k, 4), 1, generator=torch.Generator(device).manual_seed(12))
    q_rows = q.expand(N, k, 4).contiguous() if draft_probs else None
    out = full.verify(logits, candidates.view(N, k), batch, q_rows)
    return out.tokens.cpu(), out.accept_lengths.cpu()


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=4).float() / len(tokens)


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_preserves_the_target_distribution(k: int, device: str) -> None:
    tokens, lengths = rejection_run(draft_probs=True, device=device, k=k)
    # N = 40000: one standard deviation of a frequency is at most 0.0025.
    assert torch.allclose(frequencies(tokens[:, 0]), torch.tensor(P), atol=0.012)
    # Expected acceptance per position is sum(min(p, q)) = 0.1 + 0.2 + 0.2 + 0.1 = 0.6.
    assert abs((lengths >= 2).float().mean() - 0.6) < 0.012
    full_rows = lengths == k + 1
    assert torch.allclose(frequencies(tokens[full_rows, k]), torch.tensor(P_BONUS), atol=0.03)
    assert (tokens[torch.arange(N), lengths - 1] >= 0).all()
    assert (tokens[torch.arange(k + 1) >= lengths.unsqueeze(1)] == -1).all()


def test_deterministic_draft_accepts_with_target_probability(device: str) -> None:
    tokens, lengths = rejection_run(draft_probs=False, device=device)
    assert torch.allclose(frequencies(tokens[:, 0]), torch.tensor(P), atol=0.012)
    # A deterministic draft of x is accepted with probability p(x): sum(q * p) here.
    assert abs((lengths == 2).float().mean() - sum(q * p for q, p in zip(Q, P, strict=True))) < 0.012


def test_seeded_verify_is_reproducible_across_batch_compositions(device: str) -> None:
    seeded = SamplingParams(seed=21)
    logits = torch.zeros(1, 4, V, device=device)
    candidates = torch.tensor([[1, 2, 3]], device=device)
    results = []
    for others in (0, 5):
        full, _ = full_with([seeded] + [SamplingParams()] * others, device)
        batch = make_batch(list(range(others + 1)), [seeded] + [SamplingParams()] * others, device)
        outs = [full.verify(logits.expand(others + 1, 4, V).contiguous(),
                            candidates.expand(others + 1, 3).contiguous(), batch) for _ in range(10)]
        results.append([(o.tokens[0].tolist(), o.accept_lengths[0].item()) for o in outs])
    assert results[0] == results[1]


# -- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_at_the_chosen_token(device: str) -> None:
    logits = torch.randn(3, V, device=device, generator=torch.Generator(device).manual_seed(6)) * 2
    params = [SamplingParams(logprobs=3, repetition_penalty=5.0, temperature=0.5), SamplingParams(),
              SamplingParams(logprobs=0, seed=1)]
    full, batch = full_with(params, device, prompts=[list(range(V)), [], []])
    out = full.sample(logits, batch)
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert torch.allclose(out.logprobs, expected.gather(1, out.tokens.unsqueeze(1)).squeeze(1))
    top = expected[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0][0]] == top.indices.tolist()
    assert [lp for _, lp in out.top_logprobs[0][0]] == pytest.approx(top.values.tolist())
    assert out.top_logprobs[1] is None
    assert out.top_logprobs[2] == [[]]


def test_verify_logprobs_cover_accepted_tokens_and_zero_the_padding(device: str) -> None:
    logits = verify_logits([[3, 4, 5], [3, 4, 5]], device)
    batch = make_batch([0, 1], [SamplingParams(logprobs=2), SamplingParams(logprobs=1)], device)
    out = GreedySampler().verify(logits, torch.tensor([[3, 0], [3, 4]], device=device), batch)
    assert out.accept_lengths.tolist() == [2, 3]
    expected = token_logprobs(logits, out.tokens)
    assert out.logprobs is not None and torch.equal(out.logprobs, expected)
    assert out.logprobs[0, 2].item() == 0.0
    assert out.top_logprobs is not None
    assert [len(steps) for steps in out.top_logprobs] == [2, 3]
    assert out.top_logprobs[1][2][0][0] == 5
    assert out.top_logprobs[0][1][0][1] == pytest.approx(5.0 - math.log(math.exp(5.0) + V - 1))


# -- contract ---------------------------------------------------------------------------------


def test_backend_for_picks_greedy_only_when_every_row_is_greedy() -> None:
    greedy, full = GreedySampler(), FullSampler(2, V)
    assert backend_for([SamplingParams(temperature=0.0), SamplingParams(top_k=1)], greedy, full) is greedy
    assert backend_for([SamplingParams(temperature=0.0), SamplingParams()], greedy, full) is full
    assert backend_for([SamplingParams(temperature=0.0, presence_penalty=0.5)], greedy, full) is full


def test_shape_mismatches_raise_with_the_shapes() -> None:
    full, batch = full_with([SamplingParams()] * 2)
    with pytest.raises(SamplingShapeError, match=r"expected \[2, V\]"):
        full.sample(torch.zeros(3, V), batch)
    with pytest.raises(SamplingShapeError, match="vocab is 32"):
        full.sample(torch.zeros(2, V + 1), batch)
    with pytest.raises(SamplingShapeError, match=r"expected \[2, 3, V\]"):
        full.verify(torch.zeros(2, 2, V), torch.zeros(2, 2, dtype=torch.int64), batch)
    with pytest.raises(SamplingShapeError, match="draft_probs"):
        full.verify(torch.zeros(2, 3, V), torch.zeros(2, 2, dtype=torch.int64), batch, torch.zeros(2, 2, 4))
    with pytest.raises(SamplingShapeError, match="2 params"):
        SamplingBatch(torch.zeros(3, dtype=torch.int64), [SamplingParams()] * 2)
