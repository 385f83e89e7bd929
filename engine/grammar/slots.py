"""Per sampler slot, the grammar matcher of the request in it: what the next token may be.

The state is rebuilt from a request's tokens whenever it (re)takes a slot (reset, then commit of
the tokens so far), so nothing but the tokens has to travel: a decode engine continues the
grammar from the first token its prefill sampled, and a preempted request from its output.
Bitmasks are filled on the host, where the committed tokens are, into int32 [rows, words].
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from splitserve.engine.grammar.bitmask import bitmask_of, words_for
from splitserve.engine.grammar.compiler import GrammarCompiler
from splitserve.engine.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)

# Verification walks a matcher over up to this many draft tokens, then rolls it back.
MAX_DRAFT_TOKENS = 32
ALL_ALLOWED = -1  # an int32 word with every bit set


class GrammarSlots:
    """The matchers of constrained requests, by sampler slot."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.words = words_for(compiler.vocab_size)
        self.matchers: dict[int, Any] = {}
        self._stop_only = bitmask_of(compiler.stop_token_ids, compiler.vocab_size)

    def reset(self, slot: int, spec: GrammarSpec | None) -> None:
        self.matchers.pop(slot, None)
        if spec is not None:
            import xgrammar as xgr

            self.matchers[slot] = xgr.GrammarMatcher(self.compiler.compile(spec))

    def constrains(self, slots: list[int]) -> bool:
        return any(s in self.matchers for s in slots)

    def commit(self, slot: int, tokens: list[int]) -> None:
        """Advances a slot's matcher over tokens it emitted."""
        matcher = self.matchers.get(slot)
        if matcher is None:
            return
        for token in tokens:
            if matcher.is_terminated():
                return
            if not matcher.accept_token(token):
                # Only a token the mask forbade gets here (e.g. forced by a stop token id):
                # the output left the grammar, so stop constraining rather than mask everything.
                logger.warning("slot %d: token %d is outside the grammar; no longer constrained", slot, token)
                self.matchers.pop(slot)
                return

    def fill(self, slots: list[int]) -> torch.Tensor:
        """int32 [len(slots), words]: each row's allowed next tokens (all, for unconstrained rows)."""
        bitmask = torch.full((len(slots), self.words), ALL_ALLOWED, dtype=torch.int32)
        for row, slot in enumerate(slots):
            matcher = self.matchers.get(slot)
            if matcher is not None:
                self._fill_row(matcher, bitmask, row)
        return bitmask

    def fill_verify(self, slots: list[int], candidates: list[list[int]]) -> torch.Tensor:
        """int32 [B, K+1, words]: the allowed tokens at each of the K+1 verified positions.

        Position j's mask holds after the row's first j draft tokens. The matcher walks the
        draft and is rolled back, so the slot's state is unchanged. Past the first draft token
        the grammar refuses, positions are left all-allowed: that token's target probability is
        zero, so verification rejects it there and nothing later is used.
        """
        k = len(candidates[0]) if candidates else 0
        if k > MAX_DRAFT_TOKENS:
            raise ValueError(f"{k} draft tokens; grammar verification walks at most {MAX_DRAFT_TOKENS}")
        bitmask = torch.full((len(slots), k + 1, self.words), ALL_ALLOWED, dtype=torch.int32)
        flat = bitmask.view(-1, self.words)
        for row, (slot, draft) in enumerate(zip(slots, candidates, strict=True)):
            matcher = self.matchers.get(slot)
            if matcher is None:
                continue
            walked = 0
            for j in range(k + 1):
                self._fill_row(matcher, flat, row * (k + 1) + j)
                if j == k or matcher.is_terminated() or not matcher.accept_token(draft[j]):
                    break
                walked += 1
            if walked:
                matcher.rollback(walked)
        return bitmask

    def _fill_row(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        if matcher.is_terminated():
            bitmask[row] = self._stop_only
        else:
            matcher.fill_next_token_bitmask(bitmask, row)
