"""Text made in the API server process from the token ids the engine core sends (`serve
--engine-process`), as vLLM's API server makes it: the core's engine thread, which the GPU waits on
between steps, then spends no time on detokenization.

Only for requests without stop strings: the core needs no text to know when they end (a stop
token ends them, and it is not text). A request with stop strings is detokenized in the core, which
must stop at the token that completes one. The API server runs the engine's own detokenizer, fed
the same tokens in the same order, so the text is the one the engine would have made.
"""

from __future__ import annotations

from typing import Any

from splitserve.api.core_protocol import ROW_FINISH, ROW_KEY, ROW_TEXT, ROW_TOKENS
from splitserve.api.detokenizer import IncrementalDetokenizer, add_one_token_each
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.request import FinishReason
from splitserve.engine.sampling_params import SamplingParams

STOP = FinishReason.STOP.value


def detokenized_by_server(params: SamplingParams) -> bool:
    """Whether the API server makes this request's text (both processes ask it of the same params)."""
    return not any(params.stop)


class ServerDetokenizers:
    """The API server's detokenizers, one per request the core sends as token ids (by the request's
    key on the wire). Opened on the event loop, used by the thread that reads the core's messages."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._by_key: dict[int, IncrementalDetokenizer] = {}

    def open(self, key: int) -> None:
        self._by_key[key] = IncrementalDetokenizer(self.tokenizer, [])

    def close(self, key: int) -> None:
        """The request's stream is gone (its output is not wanted any more)."""
        self._by_key.pop(key, None)

    def clear(self) -> None:
        self._by_key.clear()

    def __len__(self) -> int:
        return len(self._by_key)

    def fill(self, rows: list[list[Any]]) -> None:
        """Puts the text of each output row (`output_to_wire`, keyed) of requests opened here in place,
        in order: a row's tokens are added (not a stop token that ends it), then its delta taken, final
        once it ends, as the engine does. Rows of different requests share one tokenizer call."""
        batch: list[tuple[list[Any], IncrementalDetokenizer, list[int]]] = []
        keys: set[int] = set()
        for row in rows:
            key = row[ROW_KEY]
            detokenizer = self._by_key.get(key)
            if detokenizer is None:
                continue
            if key in keys:  # a request's second row in this message: its first must be taken first
                _take_deltas(batch)
                batch, keys = [], set()
            tokens = row[ROW_TOKENS]
            if row[ROW_FINISH] == STOP and tokens:
                tokens = tokens[:-1]  # the stop token is not text
            batch.append((row, detokenizer, tokens))
            keys.add(key)
            if row[ROW_FINISH] is not None:
                self._by_key.pop(key, None)  # (the event loop's `close` may have taken it since the lookup)
        _take_deltas(batch)


def _take_deltas(batch: list[tuple[list[Any], IncrementalDetokenizer, list[int]]]) -> None:
    single = [(d, tokens[0]) for _, d, tokens in batch if len(tokens) == 1]
    add_one_token_each([d for d, _ in single], [t for _, t in single])
    for row, detokenizer, tokens in batch:
        if len(tokens) > 1:
            detokenizer.add(tokens)
        row[ROW_TEXT] = detokenizer.take_delta(final=row[ROW_FINISH] is not None)
