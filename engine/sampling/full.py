"""The full sampling backend: penalties, logit bias, temperature, top-k/top-p/min-p, seeds.

Order of processing, per row:
0. a structured-output row's grammar bitmask sets every token it forbids to -inf (engine/grammar);
1. repetition penalty (HF: over prompt and output tokens, a positive logit is divided by the
   penalty and a negative one multiplied), then frequency and presence penalties (OpenAI: over
   output tokens only, `count * frequency + (count > 0) * presence` subtracted), then logit bias;
2. temperature 0 takes the argmax of those logits; otherwise they are divided by the temperature;
3. top-k and min-p (relative to the most likely token), then top-p over what they leave;
4. one draw from the softmax, as argmax(probs / E) with E ~ Exponential(1) per token (the
   exponential race: no host sync, and each row's noise comes from one generator).

Per-request state lives in tensors indexed by pool slot, sized at construction and overwritten
by reset_slot: the scalar parameters, output-token counts [max_slots, V] (int32), prompt-token
presence [max_slots, V] (bool) and, from the first request that uses one, a dense logit-bias
table [max_slots, V]. A seeded request gets its own torch.Generator, seeded before each draw from
(seed, tokens it has emitted so far), so its tokens depend only on its seed, its logits and its
position: not on the rest of the batch, and not on where it runs (a decode engine taking over from
a prefill, or a preempted request resumed in another slot, commits the tokens so far and draws on
as the unified engine would). Unseeded rows share one generator.

verify() simplification: penalties at all K+1 positions use the slot's committed state, as if
none of the K draft tokens had been emitted yet (exact when no penalties are set).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitserve.engine.grammar.bitmask import apply_bitmask
from splitserve.engine.grammar.slots import GrammarSlots
from splitserve.engine.sampling.base import (
    PAD_TOKEN,
    SampleOutput,
    SamplerBackend,
    SamplingBatch,
    accepted_prefix_length,
    check_sample_inputs,
    check_verify_inputs,
    pad_after,
)
from splitserve.engine.sampling.greedy import argmax_tokens
from splitserve.engine.sampling.logprobs import attach_logprobs
from splitserve.engine.sampling_params import SamplingParams

Fill = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for its output token `position`: splitmix64
    of the two, so that neighbouring seeds and positions give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _exponential(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return t.exponential_(generator=generator)


def _uniform(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return t.uniform_(generator=generator)


class FullSampler(SamplerBackend):
    """Every sampling parameter of SamplingParams, with per-slot state (see the module doc).

    `seed` seeds the generator shared by unseeded rows (None: a nondeterministic seed).
    """

    def __init__(
        self, max_slots: int, vocab_size: int, device: torch.device | str = "cpu", seed: int | None = None
    ) -> None:
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)

        def per_slot(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.full((max_slots,), value, dtype=dtype, device=self.device)

        self.temperature = per_slot(1.0)
        self.top_k = per_slot(vocab_size, torch.int64)
        self.top_p = per_slot(1.0)
        self.min_p = per_slot(0.0)
        self.repetition_penalty = per_slot(1.0)
        self.frequency_penalty = per_slot(0.0)
        self.presence_penalty = per_slot(0.0)
        self.output_counts = torch.zeros(max_slots, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(max_slots, vocab_size, dtype=torch.bool, device=self.device)
        self.logit_bias: torch.Tensor | None = None
        self.generators: dict[int, torch.Generator] = {}
        self.seeds: dict[int, int] = {}
        self.emitted = [0] * max_slots  # tokens committed per slot since its reset (host side)
        # Structured outputs: per-slot grammar matchers, attached by the engine (None: no grammars).
        self.grammar: GrammarSlots | None = None
        self.shared_generator = torch.Generator(device=self.device)
        if seed is None:
            self.shared_generator.seed()
        else:
            self.shared_generator.manual_seed(seed)

    # -- per-slot state ---------------------------------------------------------------------

    def reset_slot(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} is outside [0, {self.max_slots})")
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.repetition_penalty[slot] = params.repetition_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.presence_penalty[slot] = params.presence_penalty

        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        if len(prompt_ids) > 0:
            self.prompt_mask[slot, self._ids(prompt_ids)] = True

        if params.logit_bias and self.logit_bias is None:
            self.logit_bias = torch.zeros(self.max_slots, self.vocab_size, device=self.device)
        if self.logit_bias is not None:
            self.logit_bias[slot].zero_()
            if params.logit_bias:
                ids, values = zip(*params.logit_bias.items(), strict=True)
                self.logit_bias[slot, self._ids(ids)] = torch.tensor(values, device=self.device)

        if self.grammar is not None:
            self.grammar.reset(slot, params.grammar)
        self.emitted[slot] = 0
        if params.seed is None:
            self.generators.pop(slot, None)
            self.seeds.pop(slot, None)
        else:
            self.generators.setdefault(slot, torch.Generator(device=self.device))
            self.seeds[slot] = params.seed

    def commit(self, slots: torch.Tensor, tokens: list[list[int]]) -> None:
        if len(slots) != len(tokens):
            raise ValueError(f"commit got {len(slots)} slots but {len(tokens)} token lists")
        host_slots = slots.tolist()
        for slot, emitted in zip(host_slots, tokens, strict=True):
            self.emitted[slot] += len(emitted)
        if self.grammar is not None:
            for slot, emitted in zip(host_slots, tokens, strict=True):
                self.grammar.commit(slot, emitted)
        rows = [slot for slot, emitted in zip(host_slots, tokens, strict=True) for _ in emitted]
        if not rows:
            return
        cols = [token for emitted in tokens for token in emitted]
        ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((self._ids(rows), self._ids(cols)), ones, accumulate=True)

    def _ids(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    # -- logits to probabilities ------------------------------------------------------------

    def penalized_logits(
        self, logits: torch.Tensor, slots: torch.Tensor, params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        """logits [N, V] after penalties and logit bias (slots [N] say whose state applies)."""
        logits = logits.float()
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = (self.output_counts[slots] > 0) | self.prompt_mask[slots]
            penalty = self.repetition_penalty[slots].unsqueeze(1)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            counts = self.output_counts[slots].float()
            logits = (
                logits
                - self.frequency_penalty[slots].unsqueeze(1) * counts
                - self.presence_penalty[slots].unsqueeze(1) * (counts > 0).float()
            )
        if self.logit_bias is not None and any(p.logit_bias for p in params):
            logits = logits + self.logit_bias[slots]
        return logits

    def target_probs(
        self, logits: torch.Tensor, slots: torch.Tensor, params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        """The distribution [N, V] each row draws from; a temperature-0 row gets a one-hot argmax."""
        logits = self.penalized_logits(logits, slots, params)
        temperature = self.temperature[slots]
        greedy = temperature == 0
        logits = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            logits = self._filtered(logits, slots)
        probs = logits.softmax(dim=-1)
        if any(p.temperature == 0.0 for p in params):
            one_hot = torch.nn.functional.one_hot(argmax_tokens(logits), self.vocab_size).float()
            probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
        return probs

    def _filtered(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """logits with -inf outside each row's top-k, min-p and then top-p sets."""
        ordered, order = logits.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(self.vocab_size, device=logits.device)
        removed = rank >= self.top_k[slots].unsqueeze(1)
        # min-p: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        removed |= ordered < ordered[:, :1] + self.min_p[slots].log().unsqueeze(1)
        ordered = ordered.masked_fill(removed, float("-inf"))
        # top-p keeps the shortest prefix whose mass reaches top_p: drop a token once the mass
        # before it already does. top_p == 1 keeps everything, whatever the float rounding.
        probs = ordered.softmax(dim=-1)
        top_p = self.top_p[slots].unsqueeze(1)
        ordered = ordered.masked_fill((probs.cumsum(dim=-1) - probs >= top_p) & (top_p < 1.0), float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, ordered)

    # -- randomness -------------------------------------------------------------------------

    def _random(self, batch: SamplingBatch, shape: tuple[int, ...], fill: Fill) -> torch.Tensor:
        """[B, *shape] random numbers; a seeded request's row comes from its own generator."""
        out = fill(torch.empty((len(batch), *shape), device=self.device), self.shared_generator)
        seeded = [i for i, p in enumerate(batch.params) if p.seed is not None]
        if seeded:
            slots = batch.slot_list()  # a host sync without host_slots, only for batches with seeded rows
            for i in seeded:
                generator = self.generators.get(slots[i])
                if generator is None:
                    raise RuntimeError(f"slot {slots[i]} has seed {batch.params[i].seed} but no generator:"
                                       " was reset_slot called with these params?")
                fill(out[i], generator)
        return out

    def _seed_rows(self, batch: SamplingBatch) -> None:
        """Seeds the generator of every seeded row for the position it samples now (the draws of
        one sample or verify call then follow each other in that stream)."""
        if not any(p.seed is not None for p in batch.params):
            return
        for slot in set(batch.slot_list()):
            seed = self.seeds.get(slot)
            if seed is not None:
                self.generators[slot].manual_seed(position_seed(seed, self.emitted[slot]))

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row of probs [B, V] (which need not be normalised)."""
        noise = self._random(batch, (probs.shape[1],), _exponential)
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    # -- the contract -----------------------------------------------------------------------

    def grammar_masked(self, logits: torch.Tensor, batch: SamplingBatch,
                       candidates: torch.Tensor | None = None) -> torch.Tensor:
        """logits ([B, V], or [B, K+1, V] with the draft candidates [B, K]) with -inf at every token
        a row's grammar forbids there; unchanged when no row has one. The bitmask is filled on the
        host and applied with tensor ops: on a GPU, an async copy and no sync."""
        if self.grammar is None or not any(p.grammar is not None for p in batch.params):
            return logits
        slots = batch.slot_list()
        if candidates is None:
            bitmask = self.grammar.fill(slots)
        else:
            bitmask = self.grammar.fill_verify(slots, candidates.tolist())
        if self.device.type == "cuda":
            bitmask = bitmask.pin_memory()
        return apply_bitmask(logits, bitmask)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        check_sample_inputs(logits, batch, self.vocab_size)
        raw, logits = logits, self.grammar_masked(logits, batch)
        if all(p.temperature == 0.0 for p in batch.params):
            tokens = argmax_tokens(self.penalized_logits(logits, batch.slots, batch.params))
        else:
            self._seed_rows(batch)
            tokens = self._draw(self.target_probs(logits, batch.slots, batch.params), batch)
        output = SampleOutput(tokens=tokens, accept_lengths=torch.ones_like(tokens))
        return attach_logprobs(output, raw, batch.params)

    def verify(
        self,
        logits: torch.Tensor,
        candidates: torch.Tensor,
        batch: SamplingBatch,
        draft_probs: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

        Draft token x at position j is accepted with probability min(1, p(x) / q(x)); at the first
        rejection the output token is drawn from normalize(max(0, p - q)), and after K acceptances
        a bonus token is drawn from p at position K. Without draft_probs the draft is taken as
        deterministic (q one-hot on x): accept with probability p(x), else draw from p without x.
        A temperature-0 row has a one-hot p, which makes this exactly greedy verification.
        """
        check_verify_inputs(logits, candidates, batch, draft_probs, self.vocab_size)
        raw, logits = logits, self.grammar_masked(logits, batch, candidates)
        b, k = candidates.shape
        slots = batch.slots.repeat_interleave(k + 1)
        p = self.target_probs(logits.reshape(b * (k + 1), -1), slots, batch.params).view(b, k + 1, -1)
        p_draft, p_bonus = p[:, :k], p[:, k:]
        p_x = p_draft.gather(-1, candidates.unsqueeze(-1)).squeeze(-1)  # [B, K]
        if draft_probs is None:
            ratio = p_x
            residual = p_draft.scatter(-1, candidates.unsqueeze(-1), 0.0)
        else:
            q = draft_probs.float()
            ratio = p_x / q.gather(-1, candidates.unsqueeze(-1)).squeeze(-1)
            residual = (p_draft - q).clamp_min(0.0)
        # p == q leaves no residual mass; a rejection is then only float noise, so draw from p.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_draft)

        self._seed_rows(batch)
        accepted = accepted_prefix_length(self._random(batch, (k,), _uniform) < ratio)  # [B]
        rows = torch.arange(b, device=candidates.device)
        last = torch.cat([residual, p_bonus], dim=1)[rows, accepted]  # [B, V]
        tokens = torch.cat([candidates, candidates.new_full((b, 1), PAD_TOKEN)], dim=1)
        tokens[rows, accepted] = self._draw(last, batch)
        accept_lengths = accepted + 1
        output = SampleOutput(tokens=pad_after(tokens, accept_lengths), accept_lengths=accept_lengths)
        return attach_logprobs(output, raw, batch.params)
