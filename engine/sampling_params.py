"""How one request wants its tokens chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.engine.grammar.spec import GrammarSpec

# Beyond this a logit bias is a ban or a force; OpenAI caps it at 100 as well.
MAX_LOGIT_BIAS = 100.0
MAX_TOP_LOGPROBS = 20
# The sampler holds these in float32 tensors: anything larger (or not finite) overflows in the
# step and would fail every request of the batch, not just this one.
FLOAT32_MAX = 3.0e38


class InvalidSamplingParams(ValueError):
    """A sampling parameter is outside the range it can take; the message names it."""


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings (OpenAI names, plus vLLM/SGLang extensions)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's plus the top n
    grammar: GrammarSpec | None = None  # structured output: the output must match it

    @property
    def is_greedy(self) -> bool:
        """Greedy requests take the argmax; nothing else about them changes the logits."""
        return (self.temperature == 0.0 or self.top_k == 1) and not self.needs_logit_processing

    @property
    def wants_argmax_only(self) -> bool:
        """Greedy with no logprobs: the token is the argmax and nothing else is read from the logits
        (a CUDA graph's argmax serves it, and the overlap scheduler may run ahead of it)."""
        return self.is_greedy and self.logprobs is None

    @property
    def needs_logit_processing(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
            or self.grammar is not None
        )

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidSamplingParams naming the first field out of range."""
        checks: list[tuple[bool, str]] = [
            (self.max_new_tokens >= 0, f"max_tokens must be >= 0, got {self.max_new_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"),
            (not (self.ignore_eos and self.grammar is not None),
             "ignore_eos cannot be combined with a structured-output constraint: the grammar ends the output"),
            # torch.Generator.manual_seed takes 64 bits; a larger seed would fail the whole step.
            (self.seed is None or -2**63 <= self.seed < 2**64, f"seed must be in [-2^63, 2^64), got {self.seed}"),
        ]
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            checks.append((math.isfinite(value) and abs(value) <= FLOAT32_MAX,
                           f"{name} must be a finite number of at most {FLOAT32_MAX:g}, got {value}"))
        for ok, message in checks:
            if not ok:
                raise InvalidSamplingParams(message)
        for token, bias in self.logit_bias.items():
            if not 0 <= token < vocab_size:
                raise InvalidSamplingParams(f"logit_bias token id {token} is outside [0, {vocab_size})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParams(
                    f"logit_bias for token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}],"
                    f" got {bias}"
                )
        for token in self.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise InvalidSamplingParams(f"stop_token_ids entry {token} is outside [0, {vocab_size})")
