"""Settings of encoder disaggregation (EPD): the encode engine's cache, the prefill's slots."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EPDConfig:
    """How many embeddings an encoder caches, how many items a prefill receives at once, and how long."""

    encode_cache_size: int = field(default=64, metadata={
        "help": "encode role: embeddings kept by image hash (an LRU cache; a hit ships without recomputing)"})
    encode_batch_size: int = field(default=8, metadata={"help": "encode role: images per vision-tower batch"})
    embedding_slots: int = field(default=32, metadata={
        "help": "prefill role: image items receiving at once (each holds one image's rows)"})
    embedding_timeout_s: float = field(default=60.0, metadata={
        "help": "prefill role: seconds a request's image rows may take to arrive before it fails (408)"})
    embedding_write_pause_s: float = field(default=0.0, metadata={
        "help": "encode role, tests only: pause this long halfway through each embedding write (so that a "
                "killed encoder dies mid-write); 0 in production"})
    encode_answer_delay_s: float = field(default=0.0, metadata={
        "help": "encode role, tests only: hold each /v1/encode answer back this long after its rooms opened (a "
                "late answer: the call times out or its client leaves while they are open); 0 in production"})
    encode_call_timeout_s: float = field(default=30.0, metadata={
        "help": "encode role with --engine-process: seconds the API server waits for the core's answer to a "
                "/v1/encode call before it answers 503 (and has the core close the rooms it opened for it)"})

    def __post_init__(self) -> None:
        if self.encode_cache_size < 1 or self.embedding_slots < 1 or self.encode_batch_size < 1:
            raise ValueError("--encode-cache-size, --encode-batch-size and --embedding-slots must be >= 1")
        if self.embedding_timeout_s <= 0 or self.encode_call_timeout_s <= 0:
            raise ValueError("--embedding-timeout-s and --encode-call-timeout-s must be > 0")
        if self.embedding_write_pause_s < 0 or self.encode_answer_delay_s < 0:
            raise ValueError("--embedding-write-pause-s and --encode-answer-delay-s must be >= 0")
