"""Incremental detokenization with stop strings: text deltas that never split a character.

Decoding token by token breaks multi-byte characters and merges; like vLLM we decode a short
window of recent tokens and emit only what a longer window confirms. Text that might be the
start of a stop string is held back until it is known not to be one.

Tokens the tokenizer's decode drops before decoding (ids it does not know, and special tokens when
they are skipped) never enter the windows and cost no decode: the windows' text is the same
without them, and a window of nothing but such tokens no longer grows with the output (random
weights of a real model's shape emit ids past a small tokenizer's vocabulary at every step).
"""

from __future__ import annotations

from collections import deque

from splitserve.engine.checkpoints.tokenizer import TextTokenizer

# Tokens of context decoded before the new ones, so merges at the seam come out right.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas and finds its stop strings."""

    makes_text = True

    def __init__(self, tokenizer: TextTokenizer, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special = skip_special_tokens
        self.kind = (tokenizer, skip_special_tokens)  # detokenizers of one kind decode in one call
        self.decodes = tokenizer.decoded_ids(skip_special_tokens)  # which ids decode keeps: a 0/1 per id
        self.ids: list[int] = []  # the output's ids that decode keeps (the offsets index this list)
        self._recent: deque[bool] = deque(maxlen=CONTEXT_TOKENS)  # whether each of the last tokens is in `ids`
        self.text = ""  # all text decoded so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of `text` already handed out
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped_on: str | None = None

    def add(self, token_ids: list[int]) -> None:
        """Appends tokens; updates `text` and checks for stop strings."""
        for tid in token_ids:
            if self.stopped_on is not None:
                return
            if self._push(tid):
                before, after = self._windows()
                self._confirm(self.tokenizer.decode(before, self.skip_special),
                              self.tokenizer.decode(after, self.skip_special))

    def _push(self, tid: int) -> bool:
        """Appends a token; False if decode drops it (nothing to decode: the windows' text is unchanged)."""
        kept = 0 <= tid < len(self.decodes) and self.decodes[tid] == 1
        self._recent.append(kept)
        if kept:
            self.ids.append(tid)
        return kept

    def _windows(self) -> tuple[list[int], list[int]]:
        """The token windows to decode before and after the newest token."""
        return self.ids[self.prefix_offset:self.read_offset], self.ids[self.prefix_offset:]

    def _confirm(self, before: str, after: str) -> None:
        """Takes the text the newest token confirms, if it completes a character."""
        if after.endswith("\ufffd") or len(after) <= len(before):
            return  # an incomplete character: wait for the next token
        search_from = max(0, len(self.text) - self.hold)
        self.text += after[len(before):]
        # The last CONTEXT_TOKENS output tokens (of which `sum(self._recent)` are in `ids`) stay as context.
        self.prefix_offset = len(self.ids) - sum(self._recent)
        # Re-anchor so that `before` next time decodes exactly the confirmed tail.
        self.read_offset = len(self.ids)
        self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_on = best[1]

    def take_delta(self, final: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless final."""
        if final and self.stopped_on is None and self.read_offset < len(self.ids):
            # The output ends inside a character: hand out what it decodes to, replacement and all.
            before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
            after = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special)
            self.text += after[len(before):]
            self.read_offset = len(self.ids)
        end = len(self.text) if final or self.stopped_on is not None else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta


class TextElsewhere:
    """The detokenizer of a request whose text another process makes from its token ids (the API
    server of `serve --engine-process`, for a request without stop strings): none made here."""

    makes_text = False
    stopped_on: str | None = None

    def add(self, token_ids: list[int]) -> None:
        """Nothing to do: the text is made where the tokens go."""

    def take_delta(self, final: bool) -> str:
        return ""


def add_one_token_each(detokenizers: list[IncrementalDetokenizer], token_ids: list[int]) -> None:
    """`detokenizers[i].add([token_ids[i]])` for a whole step's requests, with one tokenizer call for
    every window of the same kind instead of two calls per request: at a few hundred requests a
    step, per-call overhead was most of the engine thread's time between steps (so `_push` and
    `_windows` are written out here: a method call per row costs as much as their work)."""
    # Keyed by the tokenizer object, not id(): id() raises an audit event, and an installed audit hook
    # (filelock's, on the GPU image) then runs Python code for every request of every step.
    by_kind: dict[tuple[TextTokenizer, bool], list[IncrementalDetokenizer]] = {}
    for d, tid in zip(detokenizers, token_ids, strict=True):
        if d.stopped_on is not None:
            continue
        decodes = d.decodes
        kept = 0 <= tid < len(decodes) and decodes[tid] == 1
        d._recent.append(kept)
        if kept:
            d.ids.append(tid)
            group = by_kind.get(d.kind)
            if group is None:
                group = by_kind[d.kind] = []
            group.append(d)
    for (tokenizer, skip), group in by_kind.items():
        windows = []
        for d in group:
            ids, start = d.ids, d.prefix_offset
            windows.append(ids[start:d.read_offset])
            windows.append(ids[start:])
        texts = tokenizer.decode_batch(windows, skip)
        for i, d in enumerate(group):
            d._confirm(texts[2 * i], texts[2 * i + 1])
