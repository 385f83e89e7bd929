"""One request's state inside the engine: its tokens, its KV pages, its progress. Nothing else."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.multimodal.image_items import ImageItem, cache_ids
from splitserve.engine.prefix_cache import TreeNode
from splitserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds a slot and pages
    PARKED = "parked"  # holds pages, waits on something outside the loop (a KV transfer)
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # client gone or aborted
    ERROR = "error"  # failed (transfer failure, ...): `error` says why


@dataclass(slots=True)
class TokenOutput:
    """What the engine emits for a request after a step: new tokens, new text, maybe the end."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # The request's phase stamps (engine/phase_timing.py), on its first output only.
    phase_marks: dict[str, float] | None = None


@dataclass(eq=False)
class Request:
    """A request as the scheduler and runner see it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[TokenOutput], None]
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1  # row in the request-to-page table and in per-slot sampling state
    # Bumped when the request is preempted: a step launched before that carries none of its tokens,
    # even if it is admitted again into the same slot before that step is read back (overlap).
    tenure: int = 0
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose KV is in `pages`
    cached_len: int = 0  # of those, how many came from the prefix cache at admission
    prefix_node: TreeNode | None = None  # locked prefix-cache path
    # Of the prompt's KV, the tokens on that path (found there at admission or put there once
    # computed); `publishing`: a chunk of the prompt is computing, its pages go there when done.
    published_len: int = 0
    publishing: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token_time: float | None = None
    first_token_logprob: float = 0.0  # travels to decode in the aux data (when logprobs are asked for)
    last_token_time: float | None = None
    detokenizer: Any = None
    sampler_slot: int = -1  # the slot whose full-sampler state was last reset for this request
    # Disaggregation: the prefill's bootstrap server ("host:port") and the transfer room.
    bootstrap_addr: str | None = None
    bootstrap_room: int | None = None
    # A multimodal prompt's images: the runner puts their embedding rows at their positions.
    images: list[ImageItem] = field(default_factory=list)
    # Qwen-VL: the prompt's M-RoPE table and delta (engine/multimodal/mrope.py), computed on the first step.
    mrope: tuple[Any, int] | None = None
    # Role hooks may hang their per-request state here (e.g. a KV sender or receiver).
    role_state: Any = None
    # Speculative decoding: draft tokens for the positions after the last one, offered by a
    # behaviour (the verifier) for the next step; the scheduler takes them (and clears this).
    draft_tokens: list[int] = field(default_factory=list)
    # The token ids that end it (stop tokens, EOS unless ignored): set by the engine on first use.
    stop_ids: frozenset[int] | None = None
    # `params.wants_argmax_only`, read once at admission (the overlap check asks it every step).
    argmax_only: bool = False
    # Where its time to first token went (engine/phase_timing.py); None once sent out with its first output.
    phase_marks: dict[str, float] | None = field(default_factory=dict)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """The prefix cache's key for `all_ids`: image positions keyed by their image's hash."""
        return cache_ids(self.all_ids, self.images)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_len(self) -> int:
        """Tokens known but not yet run through the model."""
        return self.total_len - self.kv_len

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < len(self.prompt_ids) or self.pending_len > 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
